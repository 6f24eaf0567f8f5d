/* Loads libpipe at run time with dlopen, as plugin hosts and language runtimes do, and checks
 * that pipe_version is there and agrees with the header it was built against. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include <pipe/pipe.h>

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: dlopen_version LIBPIPE.so\n");
    return 2;
  }
  void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fprintf(stderr, "dlopen failed: %s\n", dlerror());
    return 1;
  }
  const char *(*version)(void) = (const char *(*)(void))dlsym(lib, "pipe_version");
  if (!version) {
    fprintf(stderr, "dlsym(pipe_version) failed: %s\n", dlerror());
    return 1;
  }
  char want[32];
  snprintf(want, sizeof want, "%d.%d.%d", PIPE_VERSION_MAJOR, PIPE_VERSION_MINOR, PIPE_VERSION_PATCH);
  printf("dlopen(%s): pipe_version() = %s, header %s\n", argv[1], version(), want);
  int ok = strcmp(version(), want) == 0;
  dlclose(lib);
  return ok ? 0 : 1;
}
