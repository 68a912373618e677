"""The thread engine of one solver's stream: reader threads (``readers``) feed renderer threads
(``renderers``) through a P x T queue set (``queues``) into a ring of batch buffers, which the
consumer (``pipeline``) hands to the trainer; ``stream`` is the contract they share."""
