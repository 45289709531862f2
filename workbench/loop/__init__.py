"""The editing loop: section files with history, reload, verify, time; the file watcher and the %%section magic."""
