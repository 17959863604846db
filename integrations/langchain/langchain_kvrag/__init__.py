"""LangChain integration for kvrag."""
