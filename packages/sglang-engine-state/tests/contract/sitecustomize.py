# Put on PYTHONPATH for spawned test children, so they import SGLang on CPU too.
import cpu_stubs

cpu_stubs.install()
