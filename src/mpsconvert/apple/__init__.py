"""Apple export targets behind one protocol (target.py): Core ML (coreml/) and Core AI (coreai/),
each an FP8 artifact -> a package inside it, checked without Apple hardware, opened as a decoder
for generate / chat, and timed for validate. registry.py lists the targets (a new one is a
module and one line there), flow.py is what every target goes through (verify, build, check,
publish in one swap), torch_model.py / stateful.py are the PyTorch model both targets convert,
compare.py compares a package's outputs with PyTorch's. Importing this package loads nothing."""
