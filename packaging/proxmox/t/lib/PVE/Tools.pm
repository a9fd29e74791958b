package PVE::Tools;

# Stand-in for Proxmox's PVE::Tools (pve-common), for the plugin's tests only: the one
# function the plugin uses, run_command, with the arguments it passes (a command as an
# array, outfunc and errfunc called once per line, a timeout in seconds), and what
# pve-storage's storage_migrate passes it (a pipeline, an array of commands, run by
# bash with pipefail; logfunc called for every line of both outputs). Like the real
# one, it dies when the command fails, times out or cannot start.

use strict;
use warnings;

use IPC::Open3 qw(open3);
use IO::Select;
use Symbol qw(gensym);

use base qw(Exporter);
our @EXPORT_OK = qw(run_command);

sub run_command {
    my ($cmd, %param) = @_;
    my $outfunc = $param{outfunc} // $param{logfunc} // sub { print "$_[0]\n" };
    my $errfunc = $param{errfunc} // $param{logfunc} // sub { print STDERR "$_[0]\n" };
    if (ref($cmd->[0]) eq 'ARRAY') {
        my $quote = sub { "'" . ($_[0] =~ s/'/'\\''/gr) . "'" };
        my $line = join(' | ', map { join(' ', map { $quote->($_) } @$_) } @$cmd);
        $cmd = ['/bin/bash', '-c', "set -o pipefail; $line"];
    }
    my $timeout = $param{timeout} // 0;
    my $cmdstr = join(' ', @$cmd);

    my $err_fh = gensym;
    my $pid = open3(my $in_fh, my $out_fh, $err_fh, @$cmd);
    close($in_fh);

    my %buffer = ($out_fh => '', $err_fh => '');
    my %func = ($out_fh => $outfunc, $err_fh => $errfunc);
    my $select = IO::Select->new($out_fh, $err_fh);
    my $deadline = $timeout ? time() + $timeout : undef;
    while ($select->count) {
        if ($deadline && time() > $deadline) {
            kill('KILL', $pid);
            waitpid($pid, 0);
            die "command '$cmdstr' failed: got timeout\n";
        }
        for my $fh ($select->can_read(1)) {
            my $n = sysread($fh, my $chunk, 65536);
            if (!$n) {
                $select->remove($fh);
                $func{$fh}->($buffer{$fh}) if length($buffer{$fh});
                next;
            }
            $buffer{$fh} .= $chunk;
            while ($buffer{$fh} =~ s/^([^\n]*)\n//) {
                $func{$fh}->($1);
            }
        }
    }
    waitpid($pid, 0);
    my $code = $? >> 8;
    die "command '$cmdstr' failed: exit code $code\n" if $? != 0;
    return 0;
}

1;
