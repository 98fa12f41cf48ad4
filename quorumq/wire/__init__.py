"""The client wire: frames (msgpack maps behind a 4-byte length) checked against the
protocol's schema (`protocol`), over TCP or, for a client in the node's own process,
handed over as copies through bounded channels (`inprocess`)."""
