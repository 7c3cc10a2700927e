"""OpenAI's Responses API (`/v1/responses`): the routes and their bodies (`routes`), the reply as
output items and typed events (`output`), stored responses for `previous_response_id`
(`store`)."""
