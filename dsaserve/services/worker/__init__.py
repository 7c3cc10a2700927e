"""What a prefill and a decode worker share: settings, the process lifecycle (`Worker`),
proto <-> engine conversion, HTTP probes and Prometheus metrics. The roles' gRPC services live in
services/prefill and services/decode and build on this package, never the other way round."""
