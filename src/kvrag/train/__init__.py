"""Block fine-tuning. Imported on demand (it pulls in peft), never by `import kvrag`."""
