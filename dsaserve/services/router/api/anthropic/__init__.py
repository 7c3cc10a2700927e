"""Anthropic's Messages API (`/v1/messages`): its bodies, errors and typed stream events."""
