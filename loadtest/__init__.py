"""Load generators for a running dsaserve stack: a Locust user and an asyncio benchmark client.

Both speak the OpenAI chat API over SSE and time tokens the same way (`openai_stream`).
"""
