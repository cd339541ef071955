"""Small command-line entry points that read a whole recipe and hand one part of it to a stage
(``python -m megatron_p3o.cli.serve``). They sit above config/ and the stages, which never
import them."""
