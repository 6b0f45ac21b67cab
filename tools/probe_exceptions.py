"""Probe: which C++ exception paths crash on this machine's toolchain (run on the GPU machine)."""
import subprocess, sys, textwrap

SRC = textwrap.dedent('''
#include <torch/extension.h>
#include <sstream>
#include <stdexcept>
void throw_plain() { throw std::runtime_error("plain"); }
void throw_to_string() { throw std::runtime_error(std::string("n=") + std::to_string(5)); }
void throw_ostream() { std::ostringstream s; s << "n=" << 5; throw std::runtime_error(s.str()); }
std::string ostream_only() { std::ostringstream s; s << "n=" << 5; return s.str(); }
void torch_check_int() { TORCH_CHECK(false, "n=", 5); }
''')
CASES = ["throw_plain", "throw_to_string", "ostream_only", "throw_ostream", "torch_check_int"]

if len(sys.argv) == 1:
    for case in CASES:
        p = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True)
        print(f"{case:18s} rc={p.returncode} {p.stdout.strip()[-120:]} {p.stderr.strip()[-200:] if p.returncode else ''}")
else:
    from torch.utils.cpp_extension import load_inline
    m = load_inline("probe_exc", [SRC], functions=CASES, verbose=False, build_directory=None)
    try:
        print("returned", getattr(m, sys.argv[1])())
    except Exception as e:
        print("raised", type(e).__name__, str(e)[:60])
