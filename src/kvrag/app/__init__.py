"""What the `kvrag` command is made of and shares with the integrations: corpus splitting and the one
Chroma-backed retrieval set-up. Not imported by `import kvrag`."""
