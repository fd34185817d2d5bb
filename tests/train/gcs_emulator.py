"""`python tests/train/gcs_emulator.py PORT`: gcp-storage-emulator on 127.0.0.1:PORT, in memory.

One fix on top: the emulator sends no `x-goog-generation` header with an object's data, and
tensorstore needs it (OCDBT manifests are updated conditionally on the generation read, and
fail with "Malformed StorageGeneration" without it). The emulator still ignores preconditions
(`ifGenerationMatch`), so it cannot show that concurrent writers are refused.
"""

import sys
import threading

from gcp_storage_emulator.handlers import objects

_download = objects.download


def _download_with_generation(request, response, storage, *args, **kwargs):
  try:
    obj = storage.get_file_obj(request.params['bucket_name'], request.params['object_id'])
    response['x-goog-generation'] = str(obj['generation'])
  except Exception:  # pylint: disable=broad-except  (a missing object: the handler says 404)
    pass
  return _download(request, response, storage, *args, **kwargs)


objects.download = _download_with_generation   # before the server module builds its routes

from gcp_storage_emulator.server import create_server  # pylint: disable=g-import-not-at-top,wrong-import-position


if __name__ == '__main__':
  server = create_server('127.0.0.1', int(sys.argv[1]), in_memory=True)
  server.start()
  threading.Event().wait()
