"""The guest side: what runs inside a box. Standard library only; bound read-only into the box as `tkbox_guest`."""
