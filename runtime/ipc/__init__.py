"""weft.runtime.ipc.channel: the wires between a runtime's processes: typed messages, ZMQ channels, child processes."""
