"""Protocol adapters: Anthropic Messages and OpenAI Responses onto chat completions."""
