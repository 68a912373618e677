"""The lent GPU's session: gpu_session.sh runs every GPU check under its own limit; session_summary
renders the one-screen summary of its logs."""
