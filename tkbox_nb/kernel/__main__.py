"""`python -m tkbox_nb.kernel -f CONNECTION_FILE`: what kernel.json starts.

The notebook's box starts first, in the background, before the kernel's own imports (zmq and the app), so that the
box and the ipykernel inside it are ready as soon as possible after the frontend connects.
"""

import os
import sys

from tkbox_nb.box.notebook_box import NotebookBox

# the most the kernel's own imports wait for the box's processes to be spawned (docs/jupyter.md, "Start to the
# first result"): the box's start is the longer way to the first cell's result; kernel_info never waits for the box
SPAWN_WAIT_S = 0.3

nb = None
if os.environ.get("TKBOX_EARLY_BOX", "1") != "0" and ({"-f", "--connection-file"} & set(sys.argv[1:])
                                                       or any(a.startswith("--connection-file=") for a in sys.argv)):
    try:  # whatever the policy, image or signer, the kernel answers kernel_info: a box's failure is the cell's
        nb = NotebookBox.for_kernel()
        nb.start_early()
        nb.wait_spawned(SPAWN_WAIT_S)
    except Exception as e:
        sys.stderr.write(f"[tkbox kernel] the box did not start early: {type(e).__name__}: {e}\n")
        nb = None

from tkbox_nb.jupyter.kernel.app import main  # noqa: E402  (after the box's start, on purpose)

sys.exit(main(nb=nb))
