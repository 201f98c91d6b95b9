"""An OpenAI-compatible HTTP front in front of Triton.

Clients written against the official ``openai`` package call ``/v1/images/generations``,
``/v1/images/edits``, ``/v1/videos``, ``/v1/chat/completions`` and ``/v1/completions``; the front turns
each call into Triton requests over gRPC streaming (``triton_bridge``), so Triton's HTTP front end never
sees a client's JSON. Modules, one concern each:

- ``app``: the FastAPI application, authentication, error handlers, health, models list, playground page
- ``images``, ``chat``, ``videos``: the endpoints
- ``image_translation``, ``text_translation``, ``video_translation``: OpenAI request shapes to our model
  fields, and our outputs back to OpenAI shapes (pure); ``translation``: the value checks they share
- ``triton_bridge``: the gRPC streaming client, the model catalog (what each model's MODEL_INFO says)
  and readiness
- ``disconnects``: server-sent events, and a client that goes away cancels its Triton request
- ``video_jobs``: asynchronous video jobs, kept for a bounded time and size
- ``limits``: body size, JSON depth and multipart limits, applied before anything is parsed
- ``errors``: OpenAI-shaped errors, and Triton's per-request errors turned into them
- ``keys``: API keys (bearer tokens)
"""
