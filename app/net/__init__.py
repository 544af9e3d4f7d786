"""Everything the service sends out: requests to URLs a client named (webhooks, ``audio_url``)
through one guard (``outbound``: destinations judged by their addresses (``addresses``) where
the connection is made, bounded in time, bytes and concurrency, slots shared fairly between API
keys (``slots``)), the ``audio_url`` download (``fetch``), and S3 (``s3``)."""
