

# The largest request body, in MiB (serve --max-request-mb). Long agent conversations reach a few MB of JSON; a
# full 262k-token context is about 1 MB of text. Here, not in body_limit, so the CLI's parser needs no FastAPI.
DEFAULT_MAX_REQUEST_MB = 8
