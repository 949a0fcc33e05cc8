"""The embedded server's corrections of mongoeco, where lily's semantics depend on MongoDB's behaviour.

Imported only by :func:`lily_mongo.embedded.serve`, in the server's own process, and
only on the mongoeco versions the suite ran on (``embedded.TESTED_MONGOECO``): every
module reaches into mongoeco's internals, through subclasses of its engine, wire
executor and sessions that only the server started here uses. One module per
concern, lowest first (docs/emulator.md says what each changes, and why):

* :mod:`.errors`: MongoDB's error replies, and the signals the engine raises past
  mongoeco's own handlers;
* :mod:`.locks`: the document locks transactions hold, and the writers waiting for one;
* :mod:`.transactions`: the open transactions, what each wrote and which the server aborted;
* :mod:`.indexes`: lookups through mongoeco's hash maps where it walks a collection;
* :mod:`.commit`: a transaction's commit, document by document;
* :mod:`.engine`: the memory engine with those rules;
* :mod:`.handshake`, :mod:`.parameters`, :mod:`.retries`: ``hello`` as a replica set,
  ``getParameter`` / ``setParameter``, retryable writes answered once;
* :mod:`.commands`: the wire layer (deadlines, refusals, transaction numbering);
* :mod:`.server`: the server, with the reaper of old transactions.
"""

from __future__ import annotations
