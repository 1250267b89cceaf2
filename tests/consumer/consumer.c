/* A program outside the kvferry tree: proves the headers, libraries,
 * CMake package and pkg-config file of an install, or of the build tree,
 * are enough to build against kvferry. */
#include <stdio.h>
#include <string.h>

#include <kvferry/kvferry.h>

int main(void) {
  if (kvf_version() != KVF_VERSION_NUMBER) {
    fprintf(stderr, "library version %u != header version %d\n", kvf_version(), KVF_VERSION_NUMBER);
    return 1;
  }
  if (strcmp(kvf_version_string(), KVF_VERSION_STRING) != 0) {
    fprintf(stderr, "library version '%s' != header version '%s'\n", kvf_version_string(), KVF_VERSION_STRING);
    return 1;
  }
  if (strcmp(kvf_status_string(KVF_SUCCESS), "success") != 0 ||
      strcmp(kvf_status_string(KVF_ERR_INVALID_GEOMETRY), "unknown status") == 0) {
    fprintf(stderr, "kvf_status_string gave unexpected names\n");
    return 1;
  }

  kvf_geometry *geometry = NULL;
  kvf_status st = kvf_geometry_create(&geometry);
  if (st != KVF_SUCCESS || geometry == NULL) {
    fprintf(stderr, "kvf_geometry_create: %s: %s\n", kvf_status_string(st), kvf_last_error());
    return 1;
  }
  kvf_geometry_destroy(geometry);
  kvf_geometry_destroy(NULL);

  /* Any of these is fine here; the point is that it links and returns. */
  kvf_cuda_info info = KVF_CUDA_INFO_INIT;
  st = kvf_cuda_probe(&info);
  if (st != KVF_SUCCESS && st != KVF_ERR_NO_DRIVER && st != KVF_ERR_NO_DEVICE) {
    fprintf(stderr, "kvf_cuda_probe: %s: %s\n", kvf_status_string(st), kvf_last_error());
    return 1;
  }

  printf("kvferry %s ok (cuda: %s)\n", kvf_version_string(), info.message);
  return 0;
}
