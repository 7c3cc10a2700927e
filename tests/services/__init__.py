"""The services one at a time: router, workers, registry, transfer, settings, deploy files."""
