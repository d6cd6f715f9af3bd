"""Serving: the OpenAI protocol, the HTTP app and its start-up, the scheduler, metrics, the load generator."""
