"""The OpenAI-compatible front door: FastAPI app, worker selection, and the prefill->decode flow.

Torch-free by design (a test checks it): the router only tokenizes and talks gRPC.
Entry points: `services.router.main` (CLI) and `services.router.app.create_app` (tests, embedding).
"""
