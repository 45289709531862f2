"""From the plan and the section files to machine code: the generated header, assembly, NVRTC and clang builds."""
