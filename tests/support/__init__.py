"""Test helpers shared by the tiers, one concern a module.

- ``broker``: the RabbitMQ of one test (unique names, inspection, publishing, consumers on it).
- ``mongo``: the MongoDB of one test, a command log, and collecting the sockets PyMongo abandons.
- ``proxy``: a TCP proxy in front of the MongoDB server that cuts connections.
- ``consumers``: running a consumer for a block, the handlers every tier uses, ended deliveries.
- ``polling``: waiting, bounded, for a condition to hold.
- ``frames``: AMQP frames written by hand, and a producer that sends them.
- ``equality``: equality of the same types all the way down.
- ``messages``: messages as the engine's preparing reads them, which no settlement may touch.
- ``asyncapi``: reading AsyncAPI documents.
- ``processes``: child processes a test starts, stops with a signal and never leaves running.
- ``cli``: the ``lily-mongo`` command run as a child process, and in-process.
- ``probes``: the HTTP probes a command serves.
"""
