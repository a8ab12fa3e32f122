"""Collective paths stepscope cannot time, by the name their ``unseen_<path>`` counter uses.

Shared by the recording side (:mod:`stepscope.instrument.collective_timing` counts them) and the
report (:mod:`stepscope.analysis.coverage` names them), without importing torch.
"""

#: Paths whose collectives stepscope cannot time, counted per step as ``unseen_<path>``
#: counters so the report says which (their waits are not attributed).
UNSEEN = {
    "coalesced": "collectives issued inside a coalescing block (batch_isend_irecv on NCCL, "
    "_coalescing_manager): the work runs at the block's exit, in C++",
    "traced": "functional collectives called while tracing (make_fx, fake or proxy "
    "modes): they run inside the captured graph",
    "untimed": "collectives issued from C++ (a ProcessGroup method called directly, a "
    "framework's native code) on a process group that carried no timed call: its sequence "
    "number moved on, stepscope saw nothing",
    "compiled": "collectives inside compiled graphs (torch.compile: dynamo turns them into "
    "_c10d_functional graph ops that the compiled code runs): not timed, and waits there are "
    "not attributed",
}
