"""skiff-gateway: one front door (ZeroMQ and HTTP) over many workers."""
