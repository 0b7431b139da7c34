"""Test support, written once and imported by the tests and by bench/ alike.

servers: throwaway redis-server / valkey-server processes and clusters; procs: child
processes (uvicorn, granian, the example app) started and stopped by PID; asgi: the ASGI
driver and a scripted handler; inproc: a run-counting app and a retrying client over ASGI;
http_pool: a raw keep-alive HTTP client for load; proxy: the fault-injecting TCP proxy;
backends: the stores under test; responses: checks on what the middleware answered;
waits: waiting for an event with a deadline, never sleeping for a guess;
apps: the small apps and scripts the tests run in child processes.
"""
