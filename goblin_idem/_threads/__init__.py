"""The thread machinery of sync code: the process's loop thread, where sync callers' store
calls run (`_loop`); one sync call's hand-over with it (`_exchange`); and records whose
transaction lives in the caller's thread, stepped through that hand-over (`_records`).

Used by the sync front doors (WSGI, Flask, Django under WSGI, a sync `once`) and handed,
as a runner, to the claims of the others (`_loop.in_loop_thread`); nothing below the uses
of a claim imports it.
"""
