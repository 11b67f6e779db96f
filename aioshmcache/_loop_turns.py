"""Loop turns that the package's own I/O callbacks witness, counted per thread.

The async faces (``aio``) restart their checkpoint count at the first inline call after the
event loop turned (``aio.CHECKPOINT_EVERY``). To learn of a turn they queue a callback on the
loop, which costs a handle, the ``getpid`` system call of Python 3.11's
``asyncio.get_running_loop``, and one more loop iteration (an ``epoll_wait`` that returns at
once) on each call of a gateway that awaits an engine's answer after each hand-out. asyncio
and uvloop count no loop iterations that could be read instead.

An I/O callback (``data_received``) runs only from the loop, after the task that made the last
inline call gave control back to it: the loop turned in between. The channel's connections
(``_channel_conn``, ``_channel_server``) call ``turned()`` in each; a face that finds
``turns()`` moved since its last inline call knows that the loop turned without queueing
anything. Each thread counts its own turns (a loop runs in one thread): another thread's
channel says nothing about this thread's loop. The count is the core's (``_core_api``): a C
thread-local in the compiled one, as cheap as a call (a ``threading.local`` attribute cost
~1.2k instructions more per access on Python 3.11).
"""

from __future__ import annotations

from ._core_api import core

__all__ = ["turned", "turns"]

#: count a loop turn that an I/O callback of this thread witnessed
turned = core.loop_turned
#: the loop turns counted in this thread so far
turns = core.loop_turns
