"""Where model files come from: the registry of names, downloads from a hub, the local
model store's names, and Ollama-style Modelfiles."""
