/* A static Linux program for the native tiers' tests: prints its arguments, reads stdin when asked, exits with
 * the code it is given. `hello [--exit N] [--stdin] WORDS...` */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
    int code = 0, echo_stdin = 0;
    printf("hello from a static binary (pid %d):", (int)getpid());
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--exit") == 0 && i + 1 < argc) {
            code = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--stdin") == 0) {
            echo_stdin = 1;
        } else {
            printf(" %s", argv[i]);
        }
    }
    printf("\n");
    if (echo_stdin) {
        char buf[4096];
        size_t n;
        while ((n = fread(buf, 1, sizeof buf, stdin)) > 0) fwrite(buf, 1, n, stdout);
    }
    return code;
}
