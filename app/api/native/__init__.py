"""The native family: ``POST /transcribe`` and ``/jobs`` (status, results, listing, cancellation,
progress as Server-Sent Events).

protocol.py is what the API says (a job as it answers with it, the requests' fields and their
help); serving.py what it does with the door (a request made a job, a job made an answer);
api_router.py the routes, thin; events.py the progress stream.
"""
