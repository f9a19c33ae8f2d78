"""OpenAI's Batch API, as pure domain code: files and batches (``model``), input lines
(``lines``), where they are kept (``kv``, ``store``), the work queue (``queue``) and the
runner that takes each line through the gateway's pipeline (``runner``). Transport lives
in the fronts; Redis comes in as a client object (``kv_redis``, ``queue_redis``)."""
