"""Public APIs: configs, allocation strings, engine and workflow interfaces."""
