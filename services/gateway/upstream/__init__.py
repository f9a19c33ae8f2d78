"""Behind the stages: the terminal router (``router``: endpoints or a provider, retries,
breakers, the retry budget, fallbacks, mid-stream continuation) and what it and the
stages talk to: the engines (``engines``), OpenAI-compatible providers (``providers``),
the cache service (``cache``), and the views the gateway keeps of the mesh (``picking``
fed by the scheduler's stream in ``feed``, the model ``catalog``, held-request
``demand``)."""
