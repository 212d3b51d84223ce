"""The gateway tier: an HTTPS service for phones and browsers that is one node of the federation.

Phones, browsers and other devices that cannot run a Flower SuperNode speak fedge's device
protocol (:mod:`fedge.clients.gateway.protocol`, ``docs/device-protocol.md``) to a gateway;
the gateway is one SuperNode of the run (``fedge gateway``, :mod:`fedge.clients.gateway.service`)
that hands each round to its devices and replies with their aggregate:

* :mod:`~fedge.clients.gateway.bridge`: the ClientApp side (the coordinator's instruction in, the
  pool's aggregate out);
* :mod:`~fedge.clients.gateway.pool`: who may check in, their sessions, the round in progress;
* :mod:`~fedge.clients.gateway.secure_pool`: secure aggregation inside the pool (the strategies'
  own SecAgg+ driver over a Grid whose messages are device-protocol frames);
* :mod:`~fedge.clients.gateway.web`: the web SDK and its demo page, served to browsers.

The protocol's reference client is :mod:`fedge.clients.protocol_device`. Nothing here is imported
by this package itself: a Flower-free device imports only the protocol module.
"""
