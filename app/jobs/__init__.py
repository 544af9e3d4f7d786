"""The core: jobs from upload to result, behind one door (``door``: the interface HTTP uses,
implemented by ``core``). Uploads in (``intake``, ``admission``), the durable store
(``store``, ``schema``, ``migrations``), the runner and each job's work (``runner``, ``work``,
``prep``, ``speakers``), housekeeping (``upkeep``), progress streams (``events``), upload blobs
and webhooks."""
