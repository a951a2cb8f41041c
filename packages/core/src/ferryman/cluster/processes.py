"""This machine's processes, from Linux ``/proc``: a process's state and parent, and the tree of
processes under some roots (an engine's scheduler and workers, for their GPU memory or to stop
them). Elsewhere the tree is the roots alone."""

from __future__ import annotations

import os
from collections import defaultdict


def proc_stat(pid: int) -> list[str] | None:
    """State, parent pid, ... of ``/proc/PID/stat`` (the fields after the command's name, which
    may hold spaces and parentheses); None: gone, or no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_tree(*pids: int) -> set[int]:
    """``pids`` and every live descendant of them."""
    children: dict[int, list[int]] = defaultdict(list)
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set(pids)
    for entry in entries:
        if entry.isdigit():
            stat = proc_stat(int(entry))
            if stat is not None and len(stat) > 1:
                children[int(stat[1])].append(int(entry))
    tree, todo = set(pids), list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in tree:
                tree.add(child)
                todo.append(child)
    return tree
