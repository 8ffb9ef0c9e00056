"""swakv's cluster layer: engine, scheduler, Ray actors, Serve app, CLI. Heavy imports stay lazy."""
