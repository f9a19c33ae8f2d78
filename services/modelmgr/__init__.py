"""modelmgr: the model registry over a local model store."""
