"""Worker RPC: the HTTP server each worker runs, the controller's async client and its event
loop, typed engine proxies (``remote_engine``), and the wire encoding."""
