"""The recovery wing: what lets a request survive its model's process dying or its server stopping.

- checkpoint_format.py: what a job checkpoint is (the adapters take and restore them:
  adapters/job_checkpoints.py), and its file's format;
- checkpoint_store.py: checkpoints on disk (atomic, bounded in bytes, age and time);
- checkpoint_files.py: the store's file work (a write renamed into place, spare files, reads);
- resumes.py: a model's checkpoints per request (``resume_key``): looked up after a request is parsed,
  stored after each step report, removed once the request is answered;
- drain.py: a stopping server's requests finished or checkpointed before it exits.

The retry hints that tell a client to resend or resume are errors.py's ``RetryHint``.
"""
