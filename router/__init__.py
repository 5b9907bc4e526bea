"""kvferry router: OpenAI-compatible P/D router (config -> discovery -> selection -> dispatch -> app)."""
