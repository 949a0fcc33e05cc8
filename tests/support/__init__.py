"""Test helpers shared by the tiers, one concern a module.

- ``broker``: the RabbitMQ of one test (unique names, inspection, publishing, consumers on it).
- ``mongo``: the MongoDB of one test, a command log, and collecting the sockets PyMongo abandons.
- ``proxy``: TCP proxies in front of the MongoDB server that cut connections (commits among them).
- ``outbox``: outbox records as a transaction's writer makes them.
- ``consumers``: running a consumer for a block, its ended deliveries, the tasks it leaves, one event for it.
- ``handlers``: the handlers every tier uses (accepting, refusing, taking every parameter kind).
- ``polling``: waiting, bounded, for a condition to hold.
- ``frames``: AMQP frames written by hand, and a producer that sends them.
- ``equality``: equality of the same types all the way down.
- ``resources``: what handlers record into (the lifespan's ``events``, a dependency per attempt).
- ``messages``: messages as the engine's preparing reads them, which no settlement may touch.
- ``asyncapi``: reading AsyncAPI documents.
- ``processes``: child processes a test starts, stops with a signal and never leaves running.
- ``workers``: what the worker scripts of the process tests share (JSON lines, arguments, serving).
- ``cli``: the ``lily-mongo`` command run as a child process, and in-process.
- ``probes``: the HTTP probes a command serves.
"""
