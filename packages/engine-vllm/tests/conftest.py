"""The vllm engine plugin is a workspace member (vLLM itself is its ``vllm`` extra). Where the
package is not installed (its sources copied to a GPU machine by hand) its source is put on the
path for these tests; where it is installed, the installed copy is used."""

import sys
from importlib.util import find_spec
from pathlib import Path

if find_spec("ferryman_engine_vllm") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
