"""Speculation: the DFlash drafter, DDTree tree building and the verification walk."""
