# Under TRITON_INTERPRET=1, bf16 kernels run on float32 twins (solattn/interpreter.py): hooked
# before any kernel module is imported.
from solattn import interpreter as _interpreter  # noqa: F401
