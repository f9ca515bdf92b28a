"""Worker RPC: the HTTP server each worker runs, its client, and the wire encoding."""
