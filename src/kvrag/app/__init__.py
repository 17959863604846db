"""What the `kvrag` command is made of: the command line, `kvrag serve`, corpus splitting. Its Chroma
set-up, which the integrations share, is kvrag.retrieval. Not imported by `import kvrag`."""
