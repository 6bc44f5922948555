

# The largest request body, in MiB (serve --max-request-mb). Long agent conversations reach a few MB of JSON; a
# full 262k-token context is about 1 MB of text. Here, not in body_limit, so the CLI's parser needs no FastAPI.
DEFAULT_MAX_REQUEST_MB = 8
# What `build_app` and `flashtree serve` use when not told: requests that may wait while one generates, seconds
# from a request's arrival before its generation stops, and seconds in-flight work gets at shutdown.
DEFAULT_QUEUE_SIZE = 16
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
